"""Mask repo folders on disk: atomic folder writes, and the names a folder, repo or revision may have."""
