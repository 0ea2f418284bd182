"""What the gateway and the core both need: config loading, logging and redaction, typed errors,
the tensor wire codec, hashing, metrics helpers and the generated protobuf code (in `shared.pb`)."""
