"""A claimed document's journey (stages, pages), the pipeline composing it, recovery at start-up and retention."""
