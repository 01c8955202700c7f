"""RMSNorm and LayerNorm: the launchers and references (`norm`) and their launch table (`norm_config`)."""
