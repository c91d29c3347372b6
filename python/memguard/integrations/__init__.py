"""memguard in other tools: PyTorch Lightning
(:mod:`~memguard.integrations.lightning`) and pytest
(:mod:`~memguard.integrations.pytest_plugin`). They use memguard's public
names only."""
