"""Tandem KV store: Mooncake Store in standalone mode as the shared CPU/disk KV tier."""
