// The Vercel AI SDK (`ai` + `@ai-sdk/openai-compatible`) against `ember serve`, as a
// JavaScript app would call it: generateText, streamText, generateObject with a schema, a
// forced tool call, embed and embedMany. Prints one JSON object of what came back; tests/test_clients.py checks it.
// Usage: EMBER_URL=http://127.0.0.1:PORT EMBER_MODEL=NAME node ai_sdk.mjs
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { embed, embedMany, generateObject, generateText, streamText, tool } from "ai";
import { z } from "zod";

const provider = createOpenAICompatible({
  name: "ember",
  baseURL: `${process.env.EMBER_URL}/v1`,
  apiKey: process.env.EMBER_API_KEY ?? "none",
  supportsStructuredOutputs: true, // response_format json_schema: Ember's grammar backends
});
const model = provider(process.env.EMBER_MODEL);
const prompt = "Name a colour.";
const result = {};

const text = await generateText({ model, prompt, maxOutputTokens: 12, temperature: 0 });
result.generateText = { text: text.text, finishReason: text.finishReason, usage: text.usage };

const stream = streamText({ model, prompt, maxOutputTokens: 12, temperature: 0 });
let streamed = "";
for await (const piece of stream.textStream) streamed += piece;
result.streamText = { text: streamed, finishReason: await stream.finishReason, usage: await stream.usage };

const city = z.object({
  name: z.string().max(12),
  country: z.enum(["France", "Japan", "Peru"]),
  population: z.number().int().min(0).max(99999999),
});
const object = await generateObject({ model, schema: city, prompt: "A city as JSON.", maxOutputTokens: 120, temperature: 0 });
result.generateObject = { object: object.object, finishReason: object.finishReason };

const called = await generateText({
  model,
  prompt: "What is the weather in Paris?",
  maxOutputTokens: 120,
  temperature: 0,
  tools: {
    get_weather: tool({
      description: "The weather in a city",
      inputSchema: z.object({ city: z.string().max(12) }),
    }),
  },
  toolChoice: { type: "tool", toolName: "get_weather" },
});
result.toolCall = {
  calls: called.toolCalls.map((call) => ({ toolName: call.toolName, input: call.input, toolCallId: call.toolCallId })),
  finishReason: called.finishReason,
};

const embedder = provider.embeddingModel(process.env.EMBER_MODEL);
const one = await embed({ model: embedder, value: "sunny weather" });
const many = await embedMany({ model: embedder, values: ["sunny weather", "a bright sunny day", "tax law"] });
result.embeddings = { one: one.embedding, many: many.embeddings, tokens: many.usage?.tokens };

console.log(JSON.stringify(result));
