#!/usr/bin/env node
// Stream a completion from a Folio server, loading the public schema at run time (no codegen).
//
//   npm install && node generate.js "Once upon a time" --max-tokens 32 [--address host:port]
//
// Text arrives in pieces as the server produces them; each piece is whole UTF-8 characters,
// so writing it straight to stdout is safe. Ctrl-C cancels the call, which makes the server
// abort the request and free its KV blocks.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..");

function parseArgs(argv) {
  const opts = {
    address: "127.0.0.1:50051", maxTokens: 64, temperature: undefined, ignoreEos: false, prompt: null,
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === "--address") opts.address = value();
    else if (arg === "--max-tokens") opts.maxTokens = Number.parseInt(value(), 10);
    else if (arg === "--temperature") opts.temperature = Number.parseFloat(value());
    else if (arg === "--ignore-eos") opts.ignoreEos = true;
    else if (opts.prompt === null) opts.prompt = arg;
    else throw new Error(`unexpected argument ${arg}`);
  }
  if (opts.prompt === null) throw new Error("usage: node generate.js PROMPT [--max-tokens N] [--temperature T] [--ignore-eos] [--address host:port]");
  return opts;
}

function loadGenerator() {
  const definition = protoLoader.loadSync("protos/folio/v1/generator.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: max_tokens, finish_reason, ...
    enums: String,
    longs: Number,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).folio.v1.Generator;
}

function main() {
  let opts;
  try {
    opts = parseArgs(process.argv.slice(2));
  } catch (err) {
    console.error(err.message);
    process.exit(2);
  }
  const Generator = loadGenerator();
  const client = new Generator(opts.address, grpc.credentials.createInsecure());
  const sampling = { max_tokens: opts.maxTokens, ignore_eos: opts.ignoreEos };
  if (opts.temperature !== undefined) sampling.temperature = opts.temperature;

  const call = client.Generate({ text: opts.prompt, sampling });
  process.on("SIGINT", () => call.cancel());
  call.on("data", (resp) => {
    if (resp.text) process.stdout.write(resp.text);
    if (resp.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      const u = resp.usage;
      process.stdout.write("\n");
      console.error(`[${resp.request_id}] ${resp.finish_reason}: ` +
        `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
    }
  });
  call.on("error", (err) => {
    if (err.code === grpc.status.CANCELLED) process.exit(130);
    console.error(`folio: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => client.close());
}

main();
