"""The front-ends' played twins: ``N`` ranks in one process (``commpress simulate``)."""
