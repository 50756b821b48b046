"""Small pieces every layer shares: Record, sha256 without OpenSSL, crash points, secret names."""
