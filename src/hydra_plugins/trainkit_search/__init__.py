"""trainkit's Optuna sweeper for Hydra (hydra/sweeper=optuna_study): Hydra accepts sweepers only from
the hydra_plugins package, and imports every module here on each start, so this one stays light."""
