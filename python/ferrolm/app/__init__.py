"""The application: the ``ferrolm`` command line and the demo built on the library."""
