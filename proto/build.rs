//! Generates the contract's Rust code with the vendored protoc, so a fresh
//! machine needs no system protoc.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "contextengine/v1/types.proto",
        "contextengine/v1/engine.proto",
        "contextengine/v1/host.proto",
        "ctxgate/v1/gateway.proto",
        "ctxgate/v1/harness.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let out = PathBuf::from(env::var("OUT_DIR")?);

    let mut prost = prost_build::Config::new();
    prost.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    let descriptors = out.join("ctxgate_descriptor.bin");
    tonic_prost_build::configure().file_descriptor_set_path(&descriptors).compile_with_config(
        prost,
        &protos,
        &["."],
    )?;
    // Proto3 JSON (serde) for the contract: `contextengine.v1.serde.rs`.
    pbjson_build::Builder::new().register_descriptors(&std::fs::read(&descriptors)?)?.build(&[".contextengine.v1"])?;
    Ok(())
}
