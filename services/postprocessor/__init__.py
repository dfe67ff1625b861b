"""Postprocessor tier: incremental detokenization, stop strings, output filter, finish reasons."""
