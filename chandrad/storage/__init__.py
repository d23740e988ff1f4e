"""The journal, the durable filesystem steps, the .chandrad folder layout and safe names: what
everything above stands on."""
