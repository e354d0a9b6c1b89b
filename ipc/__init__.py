"""The wire: messages and their codec, the engine config, ZMQ sockets, the tokenizer and
detokenizer, and the client library of an EngineCore process."""
