//! The context-engine contract (`proto/contextengine/v1`): generated types and
//! gRPC stubs in [`pb`], the contract's size [`limits`], request and response
//! [`validate`]ion shared by the gateway, the SDK and the conformance kit, the
//! one token [`estimate`], and the RPCs' typed names ([`Method`]).

pub mod estimate;
pub mod history;
pub mod limits;
pub mod method;
pub mod trace;
pub mod validate;

pub use method::Method;

/// Generated code, one module per proto package (the nesting lets the
/// gateway API refer to contract types).
#[allow(clippy::all, missing_docs)]
pub mod contextengine {
    pub mod v1 {
        tonic::include_proto!("contextengine.v1");
    }
}

#[allow(clippy::all, missing_docs)]
pub mod ctxgate {
    pub mod v1 {
        tonic::include_proto!("ctxgate.v1");
    }
}

/// The engine contract, `contextengine.v1`.
pub use contextengine::v1 as pb;
/// The gateway's client API, `ctxgate.v1`.
pub use ctxgate::v1 as gateway;

/// Encoded `FileDescriptorSet` of every package here, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ctxgate_descriptor");

/// The contract version this crate speaks (`EngineInfo.contract_version`).
pub const CONTRACT_VERSION: &str = "1.0";

/// Fully qualified name of the engine service, also its health service name.
pub const ENGINE_SERVICE: &str = "contextengine.v1.ContextEngine";

/// Fully qualified name of the host callback service.
pub const HOST_SERVICE: &str = "contextengine.v1.Host";

/// The id of the gateway's own in-process engine: no engine may take it.
pub const LEGACY_ENGINE_ID: &str = "legacy";
