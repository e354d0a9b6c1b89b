"""Wire messages, their codec and (later) ZMQ helpers and the client library."""
