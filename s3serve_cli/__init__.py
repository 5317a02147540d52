"""The `s3serve` command line: serve, label, train-predictor, bench.

The one package allowed to import everything (serving packages, predictors,
benchmarks); nothing imports it but its entry point and tests.
"""
