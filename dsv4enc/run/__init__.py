"""run: what ties the stages together (options, the plan, the one set-up path, the
pipeline, encoding parts, ranks and collectives, signals, progress, the summary)."""
