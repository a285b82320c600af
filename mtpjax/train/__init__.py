"""Training of target + MTP modules."""
