"""One decision per kind of node: exports of node measurements, class profiles, applying them."""
