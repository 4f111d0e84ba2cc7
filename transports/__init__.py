"""Built-in transports: inproc, zmq. Found through the `speckernel.transports` entry points."""
