"""The ``pit-tvm`` command line; each subcommand lives in its own module."""
