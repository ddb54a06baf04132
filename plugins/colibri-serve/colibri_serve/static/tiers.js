// What the dashboard, the expert atlas and the profiling page share: each tier's colour
// (the tests check screenshots against these) and the canvas's empty and frame colours.
"use strict";

const TIERS = {
  D: { name: "device pinned", rgb: [239, 68, 68] },
  d: { name: "device LRU", rgb: [249, 160, 40] },
  R: { name: "RAM pinned", rgb: [59, 130, 246] },
  r: { name: "RAM LRU", rgb: [45, 212, 191] },
  ".": { name: "disk only", rgb: [160, 160, 170] },
};
const EMPTY = [17, 17, 20];
const FRAME = [255, 255, 255];
