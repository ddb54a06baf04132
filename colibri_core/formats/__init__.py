"""Weight formats: how stored tensor bytes become numbers (float, fp8 blocks, colibri's
int8 / int4 / MXFP4 containers)."""
