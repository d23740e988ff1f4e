"""The searchable PDF, in two steps because the page image exists only while the page is at the
engine: each page's lines and words found on its image at page time (``lines``), the PDF written at
publish time (``build``: the original pages as they were, an invisible text layer, PDF/A-2b)."""
