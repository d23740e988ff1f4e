"""The model's files: where they live (the service's hub cache), asking the hub for them, downloading
them with progress and resume, what they say about the model, whether it fits the GPUs, and
`chandrad check`'s lines about it."""
