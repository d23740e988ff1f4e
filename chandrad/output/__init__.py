"""Where a document ends: its outputs (publish, the searchable PDF built by chandrad.pdf), failed/
(failures), and the webhooks and hooks told of it (delivery)."""
