"""Model files shipped with the package (``potentials.checkpoint.BUNDLED``); no code."""
