"""The engines room: the aiohttp server and the optional Ray Serve deployment around server/, and `serve --engine`."""
