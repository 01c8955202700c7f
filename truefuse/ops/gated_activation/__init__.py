"""The gated activation `act(gate) * up`: launchers and reference (`gated_activation`), and the
backward that recomputes it (`gated_recompute`)."""
