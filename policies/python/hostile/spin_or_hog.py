"""A test guest that misbehaves on purpose: a record containing "spin" makes
it loop forever, one containing "hog" makes it allocate without end; others
are kept as they are. The gateway must contain both and keep serving."""

from mlxgate_policy import keep


class DatasetTransform:
    def init(self, config: str) -> None:
        pass

    def transform(self, records):
        if any("spin" in r for r in records):
            while True:
                pass
        if any("hog" in r for r in records):
            hog = []
            while True:
                hog.append(bytearray(1 << 20))
        return [keep(r) for r in records]
