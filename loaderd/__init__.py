"""loaderd: a per-node data-loading daemon for PyTorch training.

Kept light on purpose: importing ``loaderd.client`` runs this file first, and a trainer must
not pay for the daemon's imports.
"""

__version__ = "0.1.0"
