"""Files arriving: the watcher (settled files) and intake (journaled, claimed, checked for copies)."""
