"""Several chandrad hosts on one shared inbox: claims another host can read, heartbeats, takeovers
and the markers that recognise duplicates across hosts; retention's sweep of those markers."""
