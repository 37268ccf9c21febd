// What the tests import: the SDK's public surface plus test-only paths.
export * from "../src/index.js";
export { PACKAGE_ROOT as PACKAGE_ROOT_FOR_TESTS } from "../src/proto.js";
export { certificateNames } from "../src/service.js";
