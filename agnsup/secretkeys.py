"""Which environment variable names look like secrets (shared by the policy
models, the spec builder and receipts; kept apart so the spawn path does not
import pydantic)."""
import re

SECRET_KEY = re.compile(r"(^AWS_|_TOKEN$|_SECRET$|_KEY$|_PASSWORD$|_PASSWD$|_CREDENTIALS?$|^SECRET|PASSWORD)",
                        re.IGNORECASE)


def looks_secret(key: str) -> bool:
    return bool(SECRET_KEY.search(key))
