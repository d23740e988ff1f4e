"""Pages as scanners make them: what is decided about a page image before the model reads it
(its orientation), and about a document's pages before and after (separators, blank backs,
born-digital pages)."""
