__version__ = "0.1.0"

# Bumped whenever the layout of an exported directory changes; formats not in stamp.READABLE_ARTIFACT_FORMATS are
# refused. 2: layers stacked; 3: every file's sha256; 4: weights renamed, source recorded; 5: window-only KV caches;
# 6: graphs take a write slot per row (cache_start[B]) and seq_ids; 7: continuous batching adds fused graphs;
# 8: neuron_config.json records the model type and decoder spec (7 still loads: its spec comes from config.json)
ARTIFACT_FORMAT_VERSION = 8
