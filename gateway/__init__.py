"""The gateway: auth, request limits, format sniffing, sandboxed decoding, preprocessing and
routing to a core. It never runs a model and never imports torch."""
