"""Input readers, output writer, manifest and atomic commits."""
