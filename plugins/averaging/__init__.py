"""Weight averaging: an exponential moving average of the weights (``EMA``), stochastic weight averaging (``SWA``)."""
