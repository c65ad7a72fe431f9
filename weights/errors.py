"""The one error of the weights tooling."""


class WeightsError(Exception):
    """A model could not be fetched or converted; the message says why in one line."""
