# An image holding one dflash-trt bundle at /bundle, for the chart's loader Job (bundle.loader,
# `dflash-trt deploy --loader-image`), which copies it onto the claim under the bundle's version
# folder and checks every file's sha256. Build it from the bundle folder, tagged with the version:
#   docker build -f deploy/bundle.Dockerfile -t registry/bundles/NAME:DIGEST engines/NAME
# (DIGEST: the last part of the subPath `dflash-trt deploy` prints, bundles/<bundle>-<DIGEST>).
# busybox: /bin/sh, cp, sha256sum. The files keep their modes (0644 / 0755 from the build), so the
# loader, running as the chart's podSecurityContext user, can read them.
FROM busybox:1.37
COPY . /bundle
