"""The jaxpr machinery: the update marker, finding updates, update programs."""
