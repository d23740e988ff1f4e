"""chandrad: a watch-folder OCR daemon built on Chandra OCR.

Data flows one way: ``watch`` → ``journal`` → ``prepare`` → ``engine`` → ``publish``,
wired together by ``daemon``; ``cli`` is the thin command line over it.
"""

__version__ = "0.1.0"
