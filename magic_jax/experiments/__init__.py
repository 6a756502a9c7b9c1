"""The experiment runner behind the notebooks: the ablations and their report."""
