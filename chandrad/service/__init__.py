"""The long-lived daemon: its phases and loops, a stop that always ends, the work queue, sd_notify."""
