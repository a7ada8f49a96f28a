__version__ = "0.1.0"

# Bumped whenever the layout of an exported directory changes; older artifacts are refused.
ARTIFACT_FORMAT_VERSION = 3  # 2: layer weights stacked, one KV cache tensor; 3: every file's sha256
