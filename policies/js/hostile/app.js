// A test guest that misbehaves on purpose: a record containing "spin" makes
// it loop forever, one containing "hog" makes it allocate without end (a
// memory bomb); others are kept as they are. The gateway must contain both
// and keep serving.

import { keep } from './mlxgate-policy.js';

export const datasetTransform = {
  init(config) {},
  transform(records) {
    if (records.some((r) => r.includes('spin'))) {
      for (;;) {}
    }
    if (records.some((r) => r.includes('hog'))) {
      const hog = [];
      for (;;) hog.push(new Uint8Array(1 << 20).fill(1));
    }
    return records.map((r) => keep(r));
  },
};
