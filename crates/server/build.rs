//! Generates the KServe v2 gRPC service (server, and the client the tests and the
//! benchmark use) from proto/grpc_service.proto, parsed by protox: no protoc needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/grpc_service.proto");
    let descriptors = protox::compile(["grpc_service.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
