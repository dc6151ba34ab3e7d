"""How jobs receive the published set: the precedence rule every launcher form applies
(jobenv.py), and the node's labels for Node Feature Discovery (nodefeatures.py). The CDI spec and
the marker of what a launch applied are published files: publish/cdi.py and publish/applied.py."""
