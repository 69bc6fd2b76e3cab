"""Deployment: the same engine on real SuperLinks and SuperNodes, a host per inner node.

Root's SuperLink (``root_run``) -> node hosts' bridges (``bridge``) -> their node servers
(``node_server``, the engine's node over ``grid``) -> the next level's bridges, or device
SuperNodes (``device``). ``roles`` builds the processes' command lines, ``cli`` runs them.
"""
