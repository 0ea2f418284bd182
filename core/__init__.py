"""The core: model loading, vision encoding, generation, and (as they land) the feature cache,
token compression and the token-budget scheduler. It never parses a media file."""
