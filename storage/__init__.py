"""Everything that holds bytes: records, the LMDB store, ingest, and the cache tiers."""
