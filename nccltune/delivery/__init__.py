"""How jobs receive the published set: the precedence rule every launcher form applies, and the CDI
spec that hands it to Kubernetes pods."""
